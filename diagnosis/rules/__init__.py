"""Root-cause rules: pure functions over arrays that return `base.Finding` values."""
