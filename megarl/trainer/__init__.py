"""Trainer backends: megatron-core (MegatronTrainer) and its parallel setup."""
