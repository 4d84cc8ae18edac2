"""LoRA adapters for the pytorch backend: PEFT folders read and checked (`peft_folder`), the additive term
each linear layer applies per row of a step (`layers`), and the slots, LRU and in-use counts (`manager`)."""
