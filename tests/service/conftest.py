"""Session fixtures of the service tests: one `stepahead serve` of the tiny model and one
Hugging Face oracle for every module that asks for `serve` / `hf` without defining its own
(a module's own fixture of the same name wins). Defined in `shared_fixtures.py`; do not
import them into a module: an imported copy would be a second daemon set."""

from tests.fixtures_models import tiny_model_dir  # noqa: F401
from tests.service.shared_fixtures import hf, metrics_port, openai_client, openai_serve, serve  # noqa: F401
