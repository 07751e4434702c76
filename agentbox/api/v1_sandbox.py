"""Routes: v1_sandbox (being written)."""

from fastapi import APIRouter

router = APIRouter()
