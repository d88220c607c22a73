"""One JSON object per log line (``LOG_FORMAT=json``), with the engine's fields.

The engine logs ids, classes and codes as ``extra`` fields; they become keys
here, so a log pipeline can filter on ``job`` or ``error_class`` directly. A
record's exception shows as its class and frames (file:line:function), never its
message.
"""

from __future__ import annotations

import json
import logging
from datetime import UTC, datetime

from jobs.failures import frames_text

_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD and not key.startswith("_"):
                entry[key] = (
                    value if isinstance(value, (int, float, bool, type(None))) else str(value)
                )
        if record.exc_info:
            # The exception's type and frames only: messages may quote data.
            entry["exc_type"] = record.exc_info[0].__name__ if record.exc_info[0] else None
            if record.exc_info[1] is not None:
                entry["exc_frames"] = frames_text(record.exc_info[1])
        return json.dumps(entry, sort_keys=False)
