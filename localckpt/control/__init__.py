"""Agreement across ranks: the library's own process group and the pure decisions over gathered
per-rank inventories."""
