"""A registry that needs credentials: dsec reads them from the docker config file, as
docker and skopeo do, for import and for export to the registry."""

from __future__ import annotations

import base64
import json
from pathlib import Path

from .conftest import USERS
from .helpers import Image, file, skopeo, write_layout


def test_credentials_from_the_docker_config(env: dict[str, str], tmp_path: Path,
                                            auth_registry: str, run_dsec) -> None:  # type: ignore[no-untyped-def]
    write_layout(Image([[file("secret.txt", b"behind auth")]]), tmp_path / "l")
    creds = f"alice:{USERS['alice']}"
    skopeo("copy", "--dest-tls-verify=false", "--dest-creds", creds, f"oci:{tmp_path / 'l'}:v1",
           f"docker://{auth_registry}/priv/img:v1")
    ref = f"{auth_registry}/priv/img:v1"
    p = run_dsec("import", ref, "--insecure", check=False)
    assert p.returncode != 0 and "docker login" in " ".join(p.stderr.split())
    assert "Traceback" not in p.stderr
    docker = Path(env["DOCKER_CONFIG"])
    docker.mkdir(parents=True, exist_ok=True)
    (docker / "config.json").write_text(json.dumps(
        {"auths": {auth_registry: {"auth": base64.b64encode(creds.encode()).decode()}}}))
    r = json.loads(run_dsec("import", ref, "--insecure", "--json").stdout)
    assert r["ref"] == "img@v1" and len(r["layers"]) == 1
    run_dsec("export", "img@v1", "--to-registry", f"{auth_registry}/priv/out:v2", "--insecure")
    skopeo("copy", "--src-tls-verify=false", "--src-creds", creds,
           f"docker://{auth_registry}/priv/out:v2", f"oci:{tmp_path / 'back'}:v2")
    back = json.loads(run_dsec("import", f"{tmp_path / 'back'}:v2", "--as", "back@1",
                               "--json").stdout)
    assert back["layers"][0]["content_digest"] == r["layers"][0]["content_digest"]
