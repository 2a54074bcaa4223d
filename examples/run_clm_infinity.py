#!/usr/bin/env python
"""Train a causal language model with the Hugging Face ``Trainer``, the way transformers'
``examples/pytorch/language-modeling/run_clm.py`` does, on infinity.

A stock Trainer script changes in four lines, marked ``# [infinity]`` below: the
import, the arguments dataclass (``InfinityTrainingArguments`` adds
``--infinity_config``, as ``--deepspeed`` takes a DeepSpeed config), the
pretrained model's loading (infinity's ``from_pretrained`` loads it unit by unit
into the config's tiers as the trainer is built, as ZeRO-3's ``HfDeepSpeedConfig``
makes ``from_pretrained`` partition while loading) and the trainer class.
``--infinity_config`` takes an infinity YAML/JSON config or a DeepSpeed user's own
``ds_config.json`` unchanged: its ``"auto"`` values are filled from these arguments
as under ``--deepspeed``. Everything else
(``HfArgumentParser``, ``get_last_checkpoint``, ``train(resume_from_checkpoint=...)``,
``evaluate``, ``save_model``, ``save_state``) is the stock script's.

    # one process, ZeRO-3 with parameters and optimizer states on NVMe
    python examples/run_clm_infinity.py --model_type gpt2 --config_overrides n_layer=2,n_embd=64,n_head=2 \\
        --train_file README.md --block_size 128 --output_dir clm-out --infinity_config configs/zero3-nvme.yaml \\
        --max_steps 20 --per_device_train_batch_size 4 --learning_rate 1e-3 --save_steps 10 --eval_steps 10 \\
        --eval_strategy steps --use_cpu --report_to none
    # two ranks: the same command under `torchrun --nproc_per_node 2` (or `accelerate launch`)
    # a DeepSpeed user's command line, --deepspeed ds_config.json becoming --infinity_config ds_config.json
    python examples/run_clm_infinity.py --model_name_or_path ./gpt2-local --train_file notes.txt \
        --infinity_config examples/ds_config_zero3_nvme.json --output_dir clm-ft --max_steps 20 --bf16

``--model_name_or_path DIR`` fine-tunes a local model directory instead (nothing is
downloaded); with no tokenizer (``--tokenizer_name`` or one in DIR) the text is read
as bytes (vocabulary 256). Rerunning the same command resumes from the newest
``checkpoint-N`` in ``--output_dir``.
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass, field

import torch
from transformers import CONFIG_MAPPING, AutoModelForCausalLM, AutoTokenizer, HfArgumentParser, set_seed
from transformers.trainer_utils import get_last_checkpoint

# [infinity] was: from transformers import Trainer, TrainingArguments
from infinity.integrations.transformers import InfinityTrainer, InfinityTrainingArguments, from_pretrained


@dataclass
class ModelArguments:
    model_name_or_path: str | None = field(default=None, metadata={"help": "a local model directory"})
    model_type: str | None = field(default=None, metadata={"help": "train from scratch: a config type, e.g. gpt2"})
    config_overrides: str | None = field(default=None, metadata={"help": "from scratch: n_layer=2,n_embd=64,..."})
    tokenizer_name: str | None = field(default=None, metadata={"help": "a local tokenizer directory"})


@dataclass
class DataTrainingArguments:
    train_file: str = field(metadata={"help": "a text file"})
    validation_split_percentage: int = field(default=5, metadata={"help": "held-out tail of train_file, percent"})
    block_size: int = field(default=128, metadata={"help": "tokens per training example"})


class Blocks(torch.utils.data.Dataset):
    """Consecutive ``block_size`` windows of one token stream (run_clm's ``group_texts``)."""

    def __init__(self, ids: torch.Tensor, block_size: int):
        self.blocks = ids[: len(ids) // block_size * block_size].view(-1, block_size)

    def __len__(self):
        return len(self.blocks)

    def __getitem__(self, i):
        return {"input_ids": self.blocks[i], "labels": self.blocks[i]}


def main():
    parser = HfArgumentParser((ModelArguments, DataTrainingArguments, InfinityTrainingArguments))  # [infinity]
    model_args, data_args, training_args = parser.parse_args_into_dataclasses()
    set_seed(training_args.seed)

    last_checkpoint = None
    if os.path.isdir(training_args.output_dir):
        last_checkpoint = get_last_checkpoint(training_args.output_dir)

    tokenizer_dir = model_args.tokenizer_name or model_args.model_name_or_path
    tokenizer = None
    if tokenizer_dir and os.path.isfile(os.path.join(tokenizer_dir, "tokenizer_config.json")):
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    text = open(data_args.train_file, encoding="utf-8").read()
    if tokenizer is not None:
        ids = torch.tensor(tokenizer(text)["input_ids"], dtype=torch.long)
    else:   # no tokenizer here: bytes
        ids = torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).long()
    held_out = len(ids) * data_args.validation_split_percentage // 100
    train_dataset = Blocks(ids[: len(ids) - held_out], data_args.block_size)
    eval_dataset = Blocks(ids[len(ids) - held_out:], data_args.block_size) if held_out else None

    if model_args.model_name_or_path:
        model = from_pretrained(model_args.model_name_or_path)  # [infinity] was: AutoModelForCausalLM.from_pretrained(
    else:
        config = CONFIG_MAPPING[model_args.model_type]()
        if model_args.config_overrides:
            config.update_from_string(model_args.config_overrides)
        if tokenizer is None:
            config.vocab_size = 256
        config.n_positions = max(getattr(config, "n_positions", 0), data_args.block_size)
        model = AutoModelForCausalLM.from_config(config)

    trainer = InfinityTrainer(  # [infinity] was: Trainer(; it reads --infinity_config
        model=model,
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        processing_class=tokenizer,
    )

    result = trainer.train(resume_from_checkpoint=last_checkpoint)
    trainer.save_model()   # output_dir: model.safetensors + config.json, from_pretrained loads it
    trainer.log_metrics("train", result.metrics)
    trainer.save_metrics("train", result.metrics)
    trainer.save_state()

    if eval_dataset is not None:
        metrics = trainer.evaluate()
        metrics["perplexity"] = math.exp(min(metrics["eval_loss"], 700.0))
        trainer.log_metrics("eval", metrics)
        trainer.save_metrics("eval", metrics)
    return 0


if __name__ == "__main__":
    sys.exit(main())
