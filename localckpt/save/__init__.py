"""The save path: staging into the host arena, the save job (write + replicate), async requests
and their queue, finalize and retention."""
