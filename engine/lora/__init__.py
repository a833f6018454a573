"""Multi-LoRA serving: many PEFT adapters over one base model, mixed in one batch (see request.py for the names)."""
