"""Build the shipped chat data set from the shipped corpus (data/corpus): questions about Python
standard-library docstrings, answered by quoting the docstring.

    python data/chat/make_chat_data.py          # writes python_docs_chat{,_valid}.jsonl here

Each line is one conversation, ``{"messages": [{"role": ..., "content": ...}, ...]}``. A document
of the corpus becomes conversations when it has two sentences or more and at most MAX_CHARS
characters (its first sentence, the docstring's summary line, at most MAX_SUMMARY_CHARS):

- "summary": the user shows the docstring and asks for its summary line; the assistant answers
  with the first sentence. With three sentences or more the conversation goes on (a system
  message first): the user asks what comes next, the assistant quotes the second sentence.
- "last" (three sentences or more): the user asks for the docstring's last sentence.

The question's wording rotates through a few phrasings, so the model must read it to tell first
from last. Conversations are shuffled with a fixed seed. The training corpus gives the training
file, the corpus' held-out file the held-out one, so the two share no docstring. Deterministic:
the same corpus gives byte-identical files.
"""

from __future__ import annotations

import argparse
import json
import random
import re
from pathlib import Path

HERE = Path(__file__).resolve().parent
CORPUS = HERE.parent / "corpus"
MAX_CHARS, MAX_SUMMARY_CHARS, MIN_SUMMARY_WORDS = 500, 200, 4
SEED = 0
SYSTEM = "You answer questions about the docstrings of Python's standard library by quoting them."
# A sentence ends at . ! or ? followed by a space and a capital, a quote or a bracket; not after an
# abbreviation such as "e.g.".
SENTENCE_END = re.compile(r"(?<!\be\.g\.)(?<!\bi\.e\.)(?<!\betc\.)(?<!\bvs\.)(?<=[.!?])\s+(?=[A-Z`'\"(])")
SUMMARY_QUESTIONS = (
    "Here is a docstring from Python's standard library:\n\n{doc}\n\nWhat is its summary line?",
    "What is the one-line summary of this docstring?\n\n{doc}",
    "{doc}\n\nWhich sentence of this docstring sums it up?",
)
NEXT_QUESTIONS = ("What does it say after that?", "And the sentence after the summary?")
LAST_QUESTIONS = (
    "What is the last sentence of this docstring?\n\n{doc}",
    "Here is a docstring:\n\n{doc}\n\nQuote its final sentence.",
)


def sentences(document: str) -> list[str]:
    return SENTENCE_END.split(document.strip())


def conversations(documents: list[str]) -> list[dict]:
    """The conversations of every usable document (see the module docstring), shuffled."""
    found = []
    for i, document in enumerate(documents):
        parts = sentences(document)
        summary = parts[0]
        if len(parts) < 2 or len(document) > MAX_CHARS or len(summary) > MAX_SUMMARY_CHARS \
                or len(summary.split()) < MIN_SUMMARY_WORDS:
            continue
        turns = [{"role": "user", "content": SUMMARY_QUESTIONS[i % len(SUMMARY_QUESTIONS)].format(doc=document)},
                 {"role": "assistant", "content": summary}]
        if len(parts) >= 3:
            turns = [{"role": "system", "content": SYSTEM}, *turns,
                     {"role": "user", "content": NEXT_QUESTIONS[i % len(NEXT_QUESTIONS)]},
                     {"role": "assistant", "content": parts[1]}]
            found.append({"messages": [{"role": "user",
                                        "content": LAST_QUESTIONS[i % len(LAST_QUESTIONS)].format(doc=document)},
                                       {"role": "assistant", "content": parts[-1]}]})
        found.append({"messages": turns})
    random.Random(SEED).shuffle(found)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=HERE)
    args = parser.parse_args()
    for source, target in (("python_docs.txt", "python_docs_chat.jsonl"),
                           ("python_docs_valid.txt", "python_docs_chat_valid.jsonl")):
        documents = (CORPUS / source).read_text(encoding="utf-8").split("\n\n")
        chats = conversations(documents)
        path = args.out_dir / target
        path.write_text("".join(json.dumps(chat, ensure_ascii=False) + "\n" for chat in chats), encoding="utf-8")
        turns = sum(sum(m["role"] == "assistant" for m in chat["messages"]) for chat in chats)
        print(f"{path}: {len(chats)} conversations, {turns} assistant turns, {path.stat().st_size} bytes")


if __name__ == "__main__":
    main()
