"""Launcher and controller (the paper's TOL): node agents, worker supervision, the state machine."""
