"""The step's torch side: flat batch tensors from the schedule, the model call, CUDA graphs for decode, overlapped steps."""
