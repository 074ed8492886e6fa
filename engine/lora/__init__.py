"""LoRA adapters: reading PEFT directories, naming them, and their slots."""
