"""Layer 1: the `Machine` protocol and its kinds. Knows nothing of HTTP, tools or sessions."""
