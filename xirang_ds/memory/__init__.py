"""Memory accounting: the live-storage tracker, categories, reports."""
