"""The typed config tree (DESIGN §1).

One dataclass per section, each field parsed and checked by the function in its
``metadata["parse"]``. Load with :meth:`Config.from_file` (YAML or JSON) or
:meth:`Config.from_dict`; both reject unknown keys, naming the section and the
valid keys, and wrong types or impossible values, naming the key and what was
expected. Sizes are bytes: an int, or a string such as ``"512MiB"``/``"8GiB"``.

The package: :mod:`~infinity.config.fields` (how one key is read: sizes, parsers),
:mod:`~infinity.config.sections` (the section dataclasses, their defaults and docs) and
:mod:`~infinity.config.tree` (:class:`Config`: load, dump, the rules across sections).
"""

from infinity.config import fields, sections, tree
from infinity.config.fields import ConfigError, format_size, parse_size
from infinity.config.sections import (DTYPES, LR_SCHEDULES, MASTER_FORMATS, MOMENT_FORMATS, TIERS, UPDATE_AT,
                                      DistConfig, IOConfig, OffloadConfig, OptimizerConfig, ParallelConfig,
                                      PrecisionConfig, PrefetchConfig, ScheduleConfig, TiersConfig, ZeroConfig,
                                      ZeroPPConfig)
from infinity.config.tree import Config, UpdateTiming

__all__ = fields.__all__ + sections.__all__ + tree.__all__   # each part's public names
