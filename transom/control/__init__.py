"""Launcher and controller (the paper's TOL): node agents, worker supervision, the job state machine."""
