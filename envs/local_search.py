"""A small local search engine, for agents whose hosted ``web_search`` the proxy runs itself.

``--proxy-hosted-tools web_search=envs.local_search:search`` (or ``file_search=...``): the model's
query is ranked with BM25 over a corpus on this machine, and the best pages come back as their
titles, URLs and excerpts. Nothing leaves the machine, so a job stays reproducible and a policy
under RL cannot reach the network through its searches.

The corpus is a JSONL file of ``{"url", "title", "text"}`` named by ``INVERTED_SEARCH_CORPUS``;
without one it is the Python language reference that ships with Python itself
(``pydoc_data.topics``: 79 pages, 0.5 MB), so the tool works out of the box.

    python -m envs.local_search "how does a with statement work"
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

TOP_K = 3
EXCERPT_CHARS = 600
WORD = re.compile(r"[a-z0-9]+")


@dataclass(frozen=True, slots=True)
class Page:
    url: str
    title: str
    text: str


def words(text: str) -> list[str]:
    return WORD.findall(text.lower())


class Index:
    """Okapi BM25 (k1 = 1.5, b = 0.75) over whole pages."""

    def __init__(self, pages: list[Page], k1: float = 1.5, b: float = 0.75):
        self.pages, self.k1, self.b = pages, k1, b
        self.counts = [Counter(words(p.title + " " + p.text)) for p in pages]
        self.lengths = [sum(c.values()) for c in self.counts]
        self.mean_length = sum(self.lengths) / max(len(pages), 1)
        frequency = Counter(w for c in self.counts for w in c)
        self.idf = {w: math.log(1 + (len(pages) - n + 0.5) / (n + 0.5)) for w, n in frequency.items()}

    def search(self, query: str, k: int = TOP_K) -> list[Page]:
        terms = [w for w in words(query) if w in self.idf]
        scores = []
        for i, counts in enumerate(self.counts):
            norm = self.k1 * (1 - self.b + self.b * self.lengths[i] / self.mean_length)
            score = sum(self.idf[w] * counts[w] * (self.k1 + 1) / (counts[w] + norm) for w in terms if counts[w])
            if score > 0:
                scores.append((score, -i))
        return [self.pages[-i] for _, i in sorted(scores, reverse=True)[:k]]


def corpus() -> list[Page]:
    """``INVERTED_SEARCH_CORPUS``'s pages, or Python's own language reference."""
    path = os.environ.get("INVERTED_SEARCH_CORPUS")
    if path:
        rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
        return [Page(str(r["url"]), str(r.get("title", r["url"])), str(r["text"])) for r in rows]
    from pydoc_data.topics import topics

    return [Page(f"https://docs.python.org/3/reference/#{name}", name, text) for name, text in sorted(topics.items())]


@functools.cache
def index() -> Index:
    return Index(corpus())


def search(arguments: dict) -> dict:
    """The hosted tool: the best pages for ``arguments["query"]``, as the model reads them (``text``),
    and which they are (``sources``, for the API's own output items)."""
    query = str(arguments.get("query", ""))
    found = index().search(query)
    text = "\n\n".join(
        f"[{n}] {p.title} ({p.url})\n{' '.join(p.text.split())[:EXCERPT_CHARS]}" for n, p in enumerate(found, 1)
    )
    return {"text": text or f"No results for {query!r}.", "sources": [{"url": p.url, "title": p.title} for p in found]}


if __name__ == "__main__":
    print(search({"query": " ".join(sys.argv[1:])}).text)
