"""The training package's user-facing errors (the CLI maps them to exit code 2)."""

from __future__ import annotations

from dmtd.train.cache import CacheError
from dmtd.train.checkpoint import CheckpointError
from dmtd.train.commands import TrainInputError
from dmtd.train.corpus import CorpusError

TRAIN_USER_ERRORS: tuple[type[BaseException], ...] = (CorpusError, CheckpointError, CacheError, TrainInputError)
