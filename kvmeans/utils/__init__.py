"""Small shared helpers (testing tolerances, input factories)."""
