"""Collectives on CUDA device memory: NCCL between GPUs, CUDA IPC between ranks on one GPU.

Nothing here imports cupy, torch or CUDA at import time: ``library`` loads cupy (and
through it NCCL and the CUDA runtime) on first use, so CPU-only jobs never touch them.
``selection`` decides, from every rank's device, which path a job's device tensors take;
``device.DeviceAwareCommunicator`` wraps the host communicator and sends device buffers
down that path, host buffers to the host backend.
"""
