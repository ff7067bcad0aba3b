"""The asynchronous loop: the controller and its collaborators (buffer, step bookkeeping, evaluation,
stops, run log), the trainer ranks' step protocol (spmd, follower)."""
