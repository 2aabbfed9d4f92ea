"""Moved to ``fedhet.toolkit.confusion`` (the toolkit layer under the algorithms); kept so that plug-ins importing
it still work."""

from fedhet.toolkit.confusion import (  # noqa: F401
    PAPER_TAU,
    probability_matrix,
    soft_confusion,
    template,
    template_kl,
)
