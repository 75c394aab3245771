"""The ``"xirang"`` block: schema, presets, loading and validation."""
from xirang_ds.config.loader import BLOCK_KEY, load_config, read_ds_config, to_dict, validate_block
from xirang_ds.config.schema import Section, XirangConfig
from xirang_ds.config.validate import XirangConfigError

__all__ = ["BLOCK_KEY", "Section", "XirangConfig", "XirangConfigError", "load_config",
           "read_ds_config", "to_dict", "validate_block"]
