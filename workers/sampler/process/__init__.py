"""The torch sampler in a process of its own (``--sampler torch-process``): the
parent's proxy, the child, the messages between them and the weights they
share in shared memory."""
