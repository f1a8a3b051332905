"""The renderers of the matrix document."""
