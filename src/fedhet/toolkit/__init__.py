"""The toolkit under the algorithms: flat parameter vectors (``flat``), what the local loop trains with (``local``:
seeds, the local optimisers, batches, clipping), evaluation (``evaluate``) and soft confusion matrices
(``confusion``). It imports only torch, numpy and (for annotations) the data layer and the config, so algorithms and
the engine both build on it."""
