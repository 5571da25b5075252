"""One typed, validated training configuration, resolved once at start-up.

Sources, lowest precedence first: field defaults < config file (TOML or JSON,
one table per section) < ``--set section.key=value`` < convenience flags
(``--local-nodes 3``...). The result is a frozen :class:`TrainConfig`; nothing
downstream reads environment variables or re-parses strings.

Every problem is a :class:`ConfigError` whose ``str()`` is one line naming
the field, e.g. ``training.lr: must be a positive number, got -1.0``.

Example file (TOML)::

    [training]
    mode = "local_sgd"
    lr = 1e-3

    [cluster]
    local_nodes = 3
"""

from __future__ import annotations

# The package's public names, from its modules (one role each):
#   fields.py    ConfigError, value coercion, range checks, the section mixin
#   sections.py  the sections and TrainConfig (validated on construction)
#   load.py      TOML / JSON files and dotted-key overrides -> TrainConfig
#   cli.py       --config, --set, convenience flags, exit status 2 on a bad value
#   table.py     the settings table of docs/settings.md, generated from the schema
from moshray.jobs.config.cli import (add_config_arguments, config_from_args,
                                     exit_on_config_error, parse_set)
from moshray.jobs.config.fields import ConfigError
from moshray.jobs.config.load import load_config
from moshray.jobs.config.sections import (
    CheckpointSection,
    ClusterSection,
    Compression,
    DataSection,
    MetricsSection,
    Mode,
    ModelSection,
    NoticeSourceName,
    OuterOptimizer,
    Overlap,
    TrainConfig,
    TrainingSection,
    valid_keys,
)

__all__ = [
    "CheckpointSection",
    "ClusterSection",
    "ConfigError",
    "DataSection",
    "MetricsSection",
    "ModelSection",
    "TrainConfig",
    "TrainingSection",
    "add_config_arguments",
    "config_from_args",
    "exit_on_config_error",
    "load_config",
    "parse_set",
    "valid_keys",
]
