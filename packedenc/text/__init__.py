"""Text in, embeddings out: tokenizer, sentence-transformers folders, `embed`, sharded embed.

`tokenizer.py` (the `tokenizers` wrapper, text -> packed ids) -> `sentence_transformers.py`
(backbone + Pooling / Dense / Normalize modules) -> `embed.py` (the job: sort, tokenize in the
background, token-budget batches, encode, restore order) -> `sharded.py` (resumable per-rank
shards of a corpus under torchrun).
"""
