"""Built-in demo models."""

from infinity.models.gpt import GPT, GPT_SIZES, Block, GPTConfig, GPTOutput, gpt_config, gpt_init_

__all__ = ["GPT", "GPTConfig", "GPTOutput", "Block", "gpt_config", "gpt_init_", "GPT_SIZES"]
