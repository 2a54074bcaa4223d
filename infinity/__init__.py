"""infinity: ZeRO stages 0-3 with device, host and NVMe tiers, for ordinary nn.Modules."""

from infinity.config import Config, ConfigError

__all__ = ["Config", "ConfigError"]
__version__ = "0.1.0"
