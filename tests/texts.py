"""Varied real sentences for the text tests: short and long, punctuation, non-ASCII, code, numbers;
and an ASCII fuzz (every ASCII character, specials) for the tokenizers' ASCII twin."""

import random
import string

BASE = [
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The girl is carrying a baby.",
    "A man is riding a horse.",
    "A woman is playing violin.",
    "Two men pushed carts through the woods.",
    "A man is riding a white horse on an enclosed ground.",
    "A monkey is playing drums.",
    "Someone in a gorilla costume is playing a set of drums.",
    "The new movie is awesome!",
    "The cat sits outside.",
    "The new movie is so great!!!",
    "Do you like pizza?",
    "I love pasta; my sister prefers rice (and lots of it).",
    "How do I reset my password?",
    "Click 'Forgot password' on the sign-in page, then follow the e-mail link.",
    "The quarterly revenue grew by 12.5% to $4.2 billion.",
    "Python's `sorted()` returns a new list; `list.sort()` sorts in place.",
    "def f(x): return x ** 2  # square",
    "https://example.com/path?query=1&lang=en",
    "Ça va ? Très bien, merci — et toi ?",
    "Der schnelle braune Fuchs springt über den faulen Hund.",
    "El niño comió una manzana en la mañana.",
    "日本語のテキストも問題なく処理できます。",
    "我们今天去公园散步吧。",
    "Москва — столица России.",
    "Η γρήγορη καφέ αλεπού πηδάει πάνω από το τεμπέλικο σκυλί.",
    "مرحبا بالعالم",
    "Emoji test 🙂🚀🔥 and symbols © ® ™ ± ∞",
    "naïve café résumé coöperate",
    "x",
    "OK",
    "?!",
    "   leading and trailing whitespace   ",
    "tab\tseparated\tvalues\nand a new line",
    "ALL CAPS SENTENCE ABOUT THE WEATHER",
    "The mitochondria is the powerhouse of the cell.",
    "Photosynthesis converts light energy into chemical energy.",
    "The stock market fell sharply after the announcement.",
    "Rain is expected tomorrow afternoon in the northern regions.",
]

LONG = (
    "Packed encoders process many sequences of different lengths in a single batch without padding: "
    "the tokens of all sequences are concatenated, and cumulative sequence lengths tell the attention "
    "kernel where each sequence starts and ends, so no compute is wasted on pad tokens. "
)


def sentences() -> list[str]:
    """>= 100 varied texts: the base sentences, combinations, and long texts (some past 256 tokens)."""
    out = list(BASE)
    out += [f"{a} {b}" for a, b in zip(BASE, BASE[7:] + BASE[:7])]
    out += [LONG * k for k in (1, 2, 4, 7)]
    out += [f"Question {i}: what about {BASE[i].lower().rstrip('.!?')}?" for i in range(0, len(BASE), 2)]
    return out


_SPECIAL = ["[CLS]", "[SEP]", "[MASK]", "[PAD]", "[UNK]", "[mask]", "##ing", "\x00", "\t", "\r\n", "\x0b", "\x7f"]


def ascii_fuzz(n: int, seed: int) -> list[str]:
    """Words, specials, every ASCII character (controls included), case mixed, lengths 0..400."""
    rng = random.Random(seed)
    pieces = [*string.ascii_letters, *string.digits, *string.punctuation, " ", "  ", *map(chr, range(128)),
              "The", "QUICK", "brown", "fox's", "re-entry", "naive", "cafe", "3.14159", "e-mail", *_SPECIAL]
    return [("" if i % 2 else " ").join(rng.choice(pieces) for _ in range(rng.randrange(0, 400 if i % 7 == 0 else 40)))
            for i in range(n)]
