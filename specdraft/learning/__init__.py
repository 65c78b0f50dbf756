"""Online speculative decoding (Liu et al., "Online Speculative Decoding"): the EAGLE-3 head that drafts
learns from the traffic it serves.

- ``learner.Learner`` (the serving side): when a request that drafted with the head finishes, its tokens,
  the target's features its drafter kept and the target's embeddings of its tokens go to the training
  process; new weights come back and are copied into the shared head between engine steps only; a
  rollback guard compares acceptance before and after each update.
- ``process``: the training process (spawned, nice 19, a CPU budget): a replay buffer bounded in tokens
  and the training-time test of ``specdraft train eagle3`` (``trainer.HeadTrainer``).
- ``store``: the adapted head kept per target and shipped head under the models' home, written as a new
  version directory and a pointer swapped atomically.
- ``guard``: the acceptance windows behind rollbacks and the acceptance curve.
"""

from .config import LearnConfig, learn_config

__all__ = ["LearnConfig", "learn_config"]
