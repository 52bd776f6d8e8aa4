"""`pdserve up`: the stack as supervised child processes."""
