"""`megarl verify-recovery`: exactness of a recovery strategy against a reference of its own and the engine."""
