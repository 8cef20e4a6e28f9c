"""Token trees: a round's draft chains (the draft, alternatives to its first token, chains fused
in from other drafters) merged into one trie that the target verifies in one forward pass.
Pure Python: the broker checks results against the tree, the runner lays its rows out from it."""

from __future__ import annotations


class TokenTree:
    """Draft chains merged into one tree of candidate tokens (a trie rooted at the last committed
    token): ``tokens[i]`` with parent ``parents[i]`` (-1: the root). The first chain's nodes come
    first, in order, so a tree of one chain is that chain; every node comes after its parent."""

    def __init__(self, chains: list[list[int]]) -> None:
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self._children: dict[tuple[int, int], int] = {}  # (parent, token) -> node
        for chain in chains:
            node = -1
            for tok in chain:
                child = self._children.get((node, tok))
                if child is None:
                    child = len(self.tokens)
                    self._children[(node, tok)] = child
                    self.tokens.append(tok)
                    self.parents.append(node)
                node = child

    def __len__(self) -> int:
        return len(self.tokens)

    def child(self, node: int, token: int) -> int | None:
        """The node for ``token`` after ``node`` (-1: the root), if the tree has one."""
        return self._children.get((node, token))

    def path(self, tokens: list[int]) -> list[int]:
        """The nodes of the longest leading run of ``tokens`` that is a path from the root."""
        out, node = [], -1
        for tok in tokens:
            node = self.child(node, tok)
            if node is None:
                break
            out.append(node)
        return out

    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parents))

