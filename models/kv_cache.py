"""Static KV cache: one preallocated K and one V tensor per decoder layer.

Layout of every tensor: ``[num_slots, num_kv_heads, max_model_len + 1, head_dim]``.
Slot ``s`` holds the sequence of the request in slot ``s``; position ``p`` along dim 2
holds the K (or V) of the token at absolute position ``p``. The last position,
``trash_pos = max_model_len``, is never a real token's position: padding tokens are
written there, so they never overwrite a real entry and no real query sees them (a
query at position ``p`` sees keys ``<= p`` and real positions are ``< max_model_len``).

One tensor per layer (not one stacked tensor for all layers): compiled code that
mutates a stacked cache in place was seen to copy the whole cache every layer.
"""

from __future__ import annotations

import torch

__all__ = ["KVCache"]


class KVCache:
    """Preallocated per-layer K/V buffers, written in place by the model.

    Args:
        num_layers: number of decoder layers (one K and one V tensor each).
        num_slots: number of sequences the cache holds (the largest batch).
        num_kv_heads: key/value heads per layer.
        max_model_len: longest sequence (prompt + output) a slot can hold.
        head_dim: size of one attention head.
        dtype: element type of K and V (the model's dtype).
        device: where the buffers live.

    Attributes:
        k, v: ``list[Tensor]``, one per layer, each
            ``[num_slots, num_kv_heads, max_model_len + 1, head_dim]``, zero-initialised
            (zeros, not ``empty``: a stale NaN would poison attention even where masked,
            because a masked weight of 0 times NaN is NaN).
        trash_pos: ``max_model_len``, the write position for padding tokens.
        max_model_len, num_slots, num_layers, num_kv_heads, head_dim: as given.

    Raises:
        ValueError: if a size is not positive.
    """

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        max_model_len: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        sizes = dict(num_layers=num_layers, num_slots=num_slots, num_kv_heads=num_kv_heads,
                     max_model_len=max_model_len, head_dim=head_dim)
        bad = {name: n for name, n in sizes.items() if not (isinstance(n, int) and n > 0)}
        if bad:
            raise ValueError(f"KVCache sizes must be positive ints, got {bad}")
        shape = (num_slots, num_kv_heads, max_model_len + 1, head_dim)
        k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self._init_views(k, v, max_model_len)

    def _init_views(self, k: list[torch.Tensor], v: list[torch.Tensor], max_model_len: int) -> None:
        self.k = k
        self.v = v
        self.max_model_len = max_model_len
        self.trash_pos = max_model_len
        self.num_layers = len(k)
        self.num_slots, self.num_kv_heads, _, self.head_dim = k[0].shape

    @classmethod
    def for_model(
        cls,
        config,
        num_slots: int,
        max_model_len: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> "KVCache":
        """Cache sized for a model config (anything with ``num_hidden_layers``,
        ``num_key_value_heads`` and ``head_dim``, e.g. ``ModelConfig``)."""
        return cls(config.num_hidden_layers, num_slots, config.num_key_value_heads,
                   max_model_len, config.head_dim, dtype, device)

    @property
    def max_len(self) -> int:
        """Length of dim 2: ``max_model_len + 1`` (the last position is ``trash_pos``)."""
        return self.max_model_len + 1

    @property
    def dtype(self) -> torch.dtype:
        return self.k[0].dtype

    @property
    def device(self) -> torch.device:
        return self.k[0].device

    @property
    def nbytes(self) -> int:
        """Bytes held by the K and V tensors (of this view, for a ``rows`` view)."""
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))

    def rows(self, n: int) -> "KVCache":
        """A KVCache over slots ``0..n-1`` sharing storage with this one (no copy).

        Writes through the returned cache land in this one. Raises ValueError unless
        ``1 <= n <= num_slots``.
        """
        return self.slots(0, n)

    def slots(self, start: int, stop: int) -> "KVCache":
        """A KVCache over slots ``start..stop-1`` sharing storage with this one (no copy).

        Raises ValueError unless ``0 <= start < stop <= num_slots``.
        """
        if not 0 <= start < stop <= self.num_slots:
            raise ValueError(f"slots({start}, {stop}): need 0 <= start < stop <= num_slots={self.num_slots}")
        view = KVCache.__new__(KVCache)
        view._init_views([t[start:stop] for t in self.k], [t[start:stop] for t in self.v], self.max_model_len)
        return view

    @torch.no_grad()
    def copy_slot(self, src: int, dst: int) -> None:
        """Copy every layer's K and V of slot ``src`` into slot ``dst`` (whole rows).

        Used to compact the batch when a request finishes: the request in the last
        slot moves into the freed one. Raises IndexError for a slot out of range.
        """
        for s in (src, dst):
            if not 0 <= s < self.num_slots:
                raise IndexError(f"slot {s} out of range [0, {self.num_slots})")
        if src == dst:
            return
        for t in (*self.k, *self.v):
            t[dst].copy_(t[src])

    def zero_(self) -> "KVCache":
        """Zero every buffer in place (not needed for correctness; for tests/debugging)."""
        for t in (*self.k, *self.v):
            t.zero_()
        return self

    def __repr__(self) -> str:
        return (f"KVCache(layers={self.num_layers}, slots={self.num_slots}, "
                f"kv_heads={self.num_kv_heads}, max_model_len={self.max_model_len}, "
                f"head_dim={self.head_dim}, dtype={self.dtype}, device={self.device})")
