#!/usr/bin/env python
"""Fine-tune a local Llama-family checkpoint larger than host memory with the Hugging Face ``Trainer`` on infinity.

The model is never whole in memory: ``infinity.integrations.transformers.from_pretrained``
builds it on the meta device (shapes only), and ``InfinityTrainer`` fills each decoder
layer from the checkpoint's memory-mapped safetensors files straight into the tiers the
config names as it builds the engine. With a DeepSpeed ZeRO-Infinity config (parameters
and optimizer states on NVMe) host memory holds the working set, not the model::

    python examples/finetune_llama_infinity.py --model_name_or_path ./Llama-3.2-1B --train_file notes.txt \\
        --infinity_config examples/ds_config_zero3_nvme.json --output_dir llama-ft --max_steps 200 \\
        --per_device_train_batch_size 1 --gradient_accumulation_steps 8 --learning_rate 2e-5 --warmup_steps 20 \\
        --max_grad_norm 1.0 --bf16 --save_steps 100 --logging_steps 10
    # N ranks on one machine: torchrun --nproc_per_node N examples/finetune_llama_infinity.py ...

``--infinity_config`` is the DeepSpeed user's own ``ds_config.json`` (its ``"auto"`` values
come from these arguments, ``--bf16`` included, as under ``--deepspeed``) or an infinity
config. A DeepSpeed config has no host budget of its own: infinity's is ``auto`` (half of the
available RAM per machine, shared by its ranks); to fix one, use an infinity config, e.g.
``{zero: {stage: 3}, offload: {params: nvme, optimizer: nvme, grads: nvme}, tiers: {nvme_path:
/local_nvme, host_bytes: 8GiB}}``. ``--model_name_or_path`` is a local directory saved with
``save_pretrained`` (``config.json`` and ``model.safetensors`` or its shards; nothing is
downloaded); its tokenizer reads ``--train_file`` (without one, the text's bytes are the
tokens, for a checkpoint whose vocabulary has at least 256 entries). The output directory holds
the consolidated model (``from_pretrained`` loads it) and ``checkpoint-N`` every
``--save_steps``; rerunning the command resumes from the newest.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field

import torch
from transformers import AutoConfig, AutoTokenizer, HfArgumentParser, set_seed
from transformers.trainer_utils import get_last_checkpoint

from infinity.integrations.transformers import InfinityTrainer, InfinityTrainingArguments, from_pretrained


@dataclass
class ScriptArguments:
    model_name_or_path: str = field(metadata={"help": "a local Llama-family checkpoint directory"})
    train_file: str = field(metadata={"help": "a text file to fine-tune on"})
    block_size: int = field(default=512, metadata={"help": "tokens per training example"})


class Blocks(torch.utils.data.Dataset):
    """Consecutive ``block_size`` windows of one token stream; the model shifts the labels itself."""

    def __init__(self, ids: torch.Tensor, block_size: int):
        self.blocks = ids[: len(ids) // block_size * block_size].view(-1, block_size)

    def __len__(self):
        return len(self.blocks)

    def __getitem__(self, i):
        return {"input_ids": self.blocks[i], "labels": self.blocks[i]}


def tokens(path: str, model_dir: str, vocab_size: int):
    """The file's token ids (the checkpoint's tokenizer, else bytes) and the tokenizer (or None)."""
    text = open(path, encoding="utf-8").read()
    if os.path.isfile(os.path.join(model_dir, "tokenizer_config.json")):
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        return torch.tensor(tokenizer(text)["input_ids"], dtype=torch.long), tokenizer
    if vocab_size < 256:
        raise SystemExit(f"{model_dir} has no tokenizer and a vocabulary of {vocab_size} < 256: cannot read "
                         f"{path} as bytes")
    return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).long(), None


def main() -> int:
    script, args = HfArgumentParser((ScriptArguments, InfinityTrainingArguments)).parse_args_into_dataclasses()
    set_seed(args.seed)
    config = AutoConfig.from_pretrained(script.model_name_or_path, local_files_only=True)
    ids, tokenizer = tokens(script.train_file, script.model_name_or_path, config.vocab_size)
    block = min(script.block_size, getattr(config, "max_position_embeddings", script.block_size))
    train_dataset = Blocks(ids, block)
    if len(train_dataset) == 0:
        raise SystemExit(f"{script.train_file}: {len(ids)} tokens, fewer than one block of {block}")

    # on meta: loaded unit by unit into the config's tiers when the trainer builds the engine
    model = from_pretrained(script.model_name_or_path)
    trainer = InfinityTrainer(model=model, args=args, train_dataset=train_dataset, processing_class=tokenizer)
    last = get_last_checkpoint(args.output_dir) if os.path.isdir(args.output_dir) else None
    result = trainer.train(resume_from_checkpoint=last)
    trainer.save_model()   # consolidated unit by unit: model.safetensors (+ index) and config.json
    trainer.log_metrics("train", result.metrics)
    trainer.save_state()
    return 0


if __name__ == "__main__":
    sys.exit(main())
