"""Adapters to the ecosystem's trainers. Nothing in infinity imports this package; it imports the public
layers below it (``initialization``, ``checkpoint``) and the third-party trainer it adapts, on use.

- :mod:`infinity.integrations.transformers`: Hugging Face ``Trainer`` (``InfinityTrainer``,
  ``InfinityTrainingArguments``); needs the ``hf`` extra (``pip install 'infinity[hf]'``).
- :mod:`infinity.integrations.trainer_options`: which ``TrainingArguments`` and config keys go
  together, and the errors for those that do not.
"""
