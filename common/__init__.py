"""What every side speaks: protocol, wire tensors, jobs, coding math, errors."""
