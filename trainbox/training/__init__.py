"""The trainer library: the one run of a trainer, options, data, rewards, attention, memory plan, speed."""
