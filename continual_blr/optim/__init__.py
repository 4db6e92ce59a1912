"""BLR optimisers (VON, VOGN) whose state is the posterior and whose prior is the last task's posterior."""

from .blr import VOGN, VON, BatchClosure, BayesianLearningRule, blr_data_update, blr_mean_update

__all__ = ["BayesianLearningRule", "BatchClosure", "VON", "VOGN", "blr_data_update", "blr_mean_update"]
