"""The RL loop: one library function per phase, and a plain-Python driver of the same phases."""
