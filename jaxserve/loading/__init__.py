"""Getting a model onto devices: `weights` (Hugging Face safetensors folders, placed shard by
shard on the mesh by the partition rules; `stack_layers` for the scanned layout),
`checkpoint` (orbax checkpoints: `convert` from a Hugging Face folder, `restore` onto any
mesh) and `tokenizer` (the folder's tokenizer.json and chat template, incremental
detokenization)."""
