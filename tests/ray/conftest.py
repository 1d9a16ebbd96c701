"""Ray binds to the loopback address in every test: `RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0` must be set before ray
is first imported (otherwise Ray takes the default route's interface address for its GCS, raylets and object
store), so it is set here, at collection."""

from __future__ import annotations

import os

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
