"""Small helpers shared by several subsystems: processes and networking."""
