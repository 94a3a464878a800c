"""accel-emu user-space runtime."""
