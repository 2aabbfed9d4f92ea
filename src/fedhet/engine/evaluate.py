"""Moved to ``fedhet.toolkit.evaluate`` (the toolkit layer under the algorithms); kept so that plug-ins importing
it still work."""

from fedhet.toolkit.evaluate import (  # noqa: F401
    EvalStats,
    client_accuracy,
    client_distribution_acc,
    client_test_samples,
    eval_batch_size,
    evaluate,
    evaluate_global,
    fairness,
    local_risk,
    local_test_acc,
    sampled_distribution_acc,
)
