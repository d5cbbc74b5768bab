"""An S3-protocol server on 127.0.0.1 for the benches and the chaos harness: moto's, in a process
of its own (it shares no GIL with a rank). Nothing reaches outside the machine."""

from __future__ import annotations

import socket
import subprocess
import sys
import time


class S3Server:
    """Starts the server and makes ``buckets``; ``env`` holds the ``AWS_*`` settings a job
    needs to reach it (endpoint, dummy credentials, region)."""

    def __init__(self, buckets: tuple[str, ...] = ()) -> None:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "from moto.server import main; main()", "-H", "127.0.0.1",
             "-p", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.endpoint = f"http://127.0.0.1:{port}"
        self.env = {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": "local",
                    "AWS_SECRET_ACCESS_KEY": "local", "AWS_REGION": "us-east-1"}
        import boto3

        client = boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1",
                              aws_access_key_id="local", aws_secret_access_key="local")
        deadline = time.monotonic() + 60
        while True:
            try:
                client.list_buckets()
                break
            except Exception:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    self.stop()
                    raise RuntimeError("the local S3 server did not start") from None
                time.sleep(0.2)
        for bucket in buckets:
            client.create_bucket(Bucket=bucket)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
