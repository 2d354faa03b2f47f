"""The S3 store: ``s3://bucket/prefix`` on AWS or any S3-compatible endpoint (MinIO, Ceph RGW).

Endpoint: the ``endpoint_url`` option (``--endpoint-url``), an ``?endpoint_url=`` query in the
URL, or the standard ``AWS_ENDPOINT_URL`` variable; credentials and region come from boto3's
standard chain. boto3's own retries are switched off: `dsec_cli.push.retry` is the one retry
policy, and it sees each failure mapped here into the dsec exception tree. Every S3 PUT is
atomic (readers see the old or the new object), which is all a ref update needs; large
uploads go through the transfer manager's multipart upload.
"""

from __future__ import annotations

import io
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, ClassVar
from urllib.parse import parse_qs, urlparse

import boto3
import botocore.exceptions as bexc
from boto3.exceptions import S3UploadFailedError
from boto3.s3.transfer import TransferConfig
from botocore.config import Config

from ...core.config import net_timeouts
from ...core.digests import validate_key
from ...core.errors import (
    DsecError,
    NotFoundError,
    StoreError,
    StoreTimeoutError,
    TransientStoreError,
    UsageError,
)
from .base import ObjectInfo, Store

_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]\Z")
_TRANSIENT_CODES = {"SlowDown", "Throttling", "ThrottlingException", "RequestTimeout",
                    "RequestTimeTooSkewed", "InternalError", "ServiceUnavailable",
                    "RequestLimitExceeded", "TooManyRequests"}
_AUTH_CODES = {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken",
               "InvalidToken", "AllAccessDisabled"}
MULTIPART_THRESHOLD = 64 << 20
MULTIPART_CHUNK = 16 << 20


class S3Store(Store):
    scheme: ClassVar[str] = "s3"
    preferred_read_size: ClassVar[int] = 8 << 20

    def __init__(self, url: str, bucket: str, prefix: str, endpoint_url: str | None) -> None:
        super().__init__(url)
        self.bucket = bucket
        self.prefix = prefix  # "" or "some/prefix/"
        self.endpoint_url = endpoint_url
        self.timeouts = net_timeouts()
        session = boto3.session.Session()
        region = session.region_name or "us-east-1"
        self.client: Any = session.client(
            "s3", endpoint_url=endpoint_url, region_name=region,
            config=Config(retries={"total_max_attempts": 1, "mode": "standard"},
                          connect_timeout=self.timeouts.connect,
                          read_timeout=self.timeouts.read, max_pool_connections=32,
                          s3={"addressing_style": "path" if endpoint_url else "auto"}),
        )
        self.transfer = TransferConfig(multipart_threshold=MULTIPART_THRESHOLD,
                                       multipart_chunksize=MULTIPART_CHUNK, max_concurrency=4)

    @classmethod
    def from_url(cls, url: str, **options: object) -> S3Store:
        parsed = urlparse(url)
        bucket = parsed.netloc
        if not bucket:
            raise UsageError(f"S3 store URL {url!r} names no bucket", hint="s3://BUCKET[/PREFIX]")
        if not _BUCKET.match(bucket):
            raise UsageError(f"{bucket!r} in {url!r} is not a valid S3 bucket name")
        prefix = parsed.path.strip("/")
        if prefix:
            validate_key(prefix)
            prefix += "/"
        query = parse_qs(parsed.query)
        endpoint = (options.get("endpoint_url") or (query.get("endpoint_url") or [""])[0]
                    or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL"))
        if endpoint is not None and not urlparse(str(endpoint)).scheme.startswith("http"):
            raise UsageError(f"invalid S3 endpoint URL {endpoint!r}: expected http(s)://HOST:PORT")
        clean = f"s3://{bucket}/{prefix}".rstrip("/")
        store = cls(clean, bucket, prefix, str(endpoint) if endpoint else None)
        store.check()
        return store

    # -- error mapping at the boundary ----------------------------------------------------
    @contextmanager
    def _errors(self, what: str, key: str | None = None) -> Iterator[None]:
        try:
            yield
        except DsecError:
            raise
        except bexc.ConnectTimeoutError as e:
            raise StoreTimeoutError(
                f"{what}: cannot connect to {self._where()} within {self.timeouts.connect:g}s",
                waited=self.timeouts.connect) from e
        except bexc.ReadTimeoutError as e:
            raise StoreTimeoutError(
                f"{what}: {self._where()} accepted the connection but did not answer within "
                f"{self.timeouts.read:g}s", waited=self.timeouts.read) from e
        except (bexc.EndpointConnectionError, bexc.ConnectionClosedError,
                bexc.ConnectionError) as e:
            raise TransientStoreError(f"{what}: cannot reach {self._where()}: {e}") from e
        except bexc.NoCredentialsError as e:
            raise UsageError(f"{what}: no AWS credentials found",
                             hint="set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE or "
                                  "~/.aws/credentials") from e
        except bexc.ClientError as e:
            raise self._map_client_error(e, what, key) from e
        except S3UploadFailedError as e:
            # the transfer manager wraps the request's error: map what it wraps, so that a
            # 503 on an upload is retried as on any other request
            cause = e.__cause__ or e.__context__
            if isinstance(cause, bexc.ClientError):
                raise self._map_client_error(cause, what, key) from e
            raise StoreError(f"{what}: {e}") from e
        except bexc.BotoCoreError as e:
            raise StoreError(f"{what}: {e}") from e

    def _map_client_error(self, e: bexc.ClientError, what: str, key: str | None) -> DsecError:
        err = e.response.get("Error", {})
        code = str(err.get("Code", ""))
        status = int(e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
        if code in _TRANSIENT_CODES or status == 429 or status >= 500:
            return TransientStoreError(f"{what}: {self._where()} answered {status} {code}")
        if code == "NoSuchBucket" or (key is None and status == 404):
            return UsageError(f"bucket {self.bucket!r} does not exist at {self._where()}",
                              hint="create it first, or check the URL and --endpoint-url")
        if code in ("NoSuchKey", "404", "NotFound") or status == 404:
            return NotFoundError(f"{key} not found in {self.url}")
        if code in _AUTH_CODES or status in (401, 403):
            return StoreError(f"{what}: access denied by {self._where()} ({code or status})",
                              hint="check the credentials boto3 finds (AWS_PROFILE, "
                                   "AWS_ACCESS_KEY_ID) and the bucket policy")
        return StoreError(f"{what}: {code or status}: {err.get('Message', '')}".rstrip(": "))

    def _where(self) -> str:
        return self.endpoint_url or f"s3://{self.bucket}"

    def check(self) -> None:
        """Fail early and clearly on an unreachable endpoint or a missing bucket."""
        with self._errors(f"opening {self.url}"):
            self.client.head_bucket(Bucket=self.bucket)

    # -- primitives ------------------------------------------------------------------------
    def _get(self, key: str, start: int = 0, length: int | None = None) -> bytes:
        if length == 0:
            return b""
        args: dict[str, Any] = {"Bucket": self.bucket, "Key": self.prefix + key}
        if start or length is not None:
            end = "" if length is None else str(start + length - 1)
            args["Range"] = f"bytes={start}-{end}"
        try:
            with self._errors(f"reading {key}", key):
                resp = self.client.get_object(**args)
                body: bytes = resp["Body"].read()
                return body
        except StoreError as e:
            if isinstance(e.__cause__, bexc.ClientError) and "InvalidRange" in str(e.__cause__):
                return b""  # a range past the end reads as empty, as a file does
            raise

    def _put(self, key: str, data: bytes) -> None:
        with self._errors(f"writing {key}", key):
            if len(data) >= MULTIPART_THRESHOLD:
                self.client.upload_fileobj(io.BytesIO(data), self.bucket, self.prefix + key,
                                           Config=self.transfer)
            else:
                self.client.put_object(Bucket=self.bucket, Key=self.prefix + key, Body=data)

    def put_file(self, key: str, path: Path) -> None:
        validate_key(key)
        with self._errors(f"writing {key}", key):
            self.client.upload_file(str(path), self.bucket, self.prefix + key,
                                    Config=self.transfer)

    def _stat(self, key: str) -> ObjectInfo | None:
        try:
            with self._errors(f"checking {key}", key):
                r = self.client.head_object(Bucket=self.bucket, Key=self.prefix + key)
        except NotFoundError:
            return None
        return ObjectInfo(key, int(r["ContentLength"]), r["LastModified"].timestamp())

    def _list(self, prefix: str) -> Iterator[ObjectInfo]:
        pages = self.client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=self.prefix + prefix)
        with self._errors(f"listing {prefix or '/'}"):
            for page in pages:
                for obj in page.get("Contents", ()):
                    key = obj["Key"][len(self.prefix):]
                    yield ObjectInfo(key, int(obj["Size"]), obj["LastModified"].timestamp())

    def _delete(self, key: str) -> None:
        with self._errors(f"deleting {key}", key):
            self.client.delete_object(Bucket=self.bucket, Key=self.prefix + key)

    def close(self) -> None:
        self.client.close()
