"""Routes: v2_sandbox (being written)."""

from fastapi import APIRouter

router = APIRouter()
