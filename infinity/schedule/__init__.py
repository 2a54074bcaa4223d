"""The prefetcher: records the order units are used in, then keeps the next ones coming within a byte budget."""

from infinity.schedule.prefetch import TracePrefetcher, TraceState

__all__ = ["TracePrefetcher", "TraceState"]
