"""``search``: BM25 retrieval over a local document collection (Search-R1 style tasks).

The collection is a ``.jsonl`` or ``.parquet`` file given by the ``corpus_path`` config key;
each row has a text field (``text_field``, default ``"text"``) and optionally a title
(``title_field``, default ``"title"``) and an id (``id_field``, default ``"id"``). Documents are
tokenised by lower-casing and splitting on non-alphanumerics, and ranked with Okapi BM25
(Robertson & Zaragoza, 2009) via ``rank_bm25.BM25Okapi`` (``k1``, ``b`` configurable). The index
is built once per tool object. The observation lists the ``top_k`` hits, each truncated to
``max_doc_chars``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from postrl.tools.base import BaseTool, ToolResponse

__all__ = ["SearchTool", "load_documents", "tokenize"]

_TOKEN = re.compile(r"[A-Za-z0-9]+")


def tokenize(text: str) -> list[str]:
    """Lower-cased alphanumeric tokens."""
    return [t.lower() for t in _TOKEN.findall(text)]


def load_documents(path: str | Path) -> list[dict[str, Any]]:
    """Read a ``.jsonl`` or ``.parquet`` collection into a list of row dicts."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"search tool: corpus_path {str(path)!r} does not exist")
    if path.suffix == ".jsonl":
        with path.open() as f:
            return [json.loads(line) for line in f if line.strip()]
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    raise ValueError(f"search tool: corpus_path must end in .jsonl or .parquet, got {path.name!r}")


class SearchTool(BaseTool):
    """BM25 search tool. Config: ``corpus_path`` (required), ``top_k`` (3), ``max_doc_chars``
    (500), ``text_field``, ``title_field``, ``id_field``, ``k1`` (1.5), ``b`` (0.75)."""

    def __init__(
        self, config: dict[str, Any] | None = None, tool_schema: dict[str, Any] | None = None
    ) -> None:
        super().__init__(config, tool_schema)
        if "corpus_path" not in self.config:
            raise ValueError(
                "search tool needs config.corpus_path (a .jsonl or .parquet file "
                "with a 'text' field per document)"
            )
        from rank_bm25 import BM25Okapi

        self.text_field = self.config.get("text_field", "text")
        self.title_field = self.config.get("title_field", "title")
        self.docs = load_documents(self.config["corpus_path"])
        bad = [i for i, d in enumerate(self.docs) if not isinstance(d.get(self.text_field), str)]
        if bad:
            raise ValueError(
                f"search tool: documents {bad[:5]} have no string field "
                f"{self.text_field!r}; set config.text_field"
            )
        corpus = [
            tokenize(f"{d.get(self.title_field) or ''} {d[self.text_field]}") for d in self.docs
        ]
        self.bm25 = BM25Okapi(
            corpus, k1=float(self.config.get("k1", 1.5)), b=float(self.config.get("b", 0.75))
        )
        self.top_k = int(self.config.get("top_k", 3))
        self.max_doc_chars = int(self.config.get("max_doc_chars", 500))

    @classmethod
    def default_schema(cls) -> dict[str, Any]:
        """``search(query: str)``."""
        return {
            "type": "function",
            "function": {
                "name": "search",
                "description": "Search the document collection "
                "and return the most relevant passages.",
                "parameters": {
                    "type": "object",
                    "properties": {
                        "query": {"type": "string", "description": "keywords to search for"}
                    },
                    "required": ["query"],
                },
            },
        }

    def search(self, query: str, top_k: int | None = None) -> list[tuple[int, float]]:
        """(document index, BM25 score) of the best ``top_k`` documents with a positive score."""
        scores = self.bm25.get_scores(tokenize(query))
        order = sorted(range(len(scores)), key=lambda i: -scores[i])[: top_k or self.top_k]
        return [(i, float(scores[i])) for i in order if scores[i] > 0]

    async def execute(self, instance_id: str, parameters: dict[str, Any]) -> ToolResponse:
        """Search for ``parameters['query']``; returns numbered passages or 'No results'."""
        query = parameters.get("query")
        if not isinstance(query, str) or not query.strip():
            return ToolResponse(
                "Error: 'query' must be a non-empty string",
                metrics={"tool/errors/bad_arguments": 1.0},
                error="bad_arguments",
            )
        hits = self.search(query)
        if not hits:
            return ToolResponse("No results.", metrics={"tool/search/hits": 0.0})
        lines = []
        for rank, (i, _) in enumerate(hits, 1):
            d = self.docs[i]
            title = d.get(self.title_field)
            text = d[self.text_field][: self.max_doc_chars]
            lines.append(f"[{rank}] " + (f"{title}: " if title else "") + text)
        return ToolResponse("\n".join(lines), metrics={"tool/search/hits": float(len(hits))})
