"""Routes: v2_commands (being written)."""

from fastapi import APIRouter

router = APIRouter()
