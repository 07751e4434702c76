"""Routes: v2_fs (being written)."""

from fastapi import APIRouter

router = APIRouter()
